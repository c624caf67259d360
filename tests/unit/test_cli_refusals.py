"""Every ``vllm-lowrank`` subcommand refuses a bad path or number before it
loads anything (issue 54): one ``vllm-lowrank: error:`` line naming the
problem, exit status 2, no traceback. The heavy steps (calibration, the
default artifact, the allocation, vLLM's engine) are replaced by a sentinel:
a refusal must come before them, and the valid commands of the table's last
rows must reach them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from conftest import save_tiny_artifact

from vllm_lowrank import cli
from vllm_lowrank.factorization.plan import AttentionShape


class Reached(Exception):
    """A heavy step was reached: every check before it passed."""


@pytest.fixture(autouse=True)
def heavy_steps(monkeypatch):
    """Calibration, the cached default artifact, the allocation and vLLM's
    engine raise :class:`Reached` instead of running."""
    from vllm_lowrank import evaluation
    from vllm_lowrank.calibration import allocate, cache, calibrate
    from vllm_lowrank.models import compression  # noqa: F401 (imports load_or_calibrate
    # by name: imported first here, it keeps the real one, not the sentinel)

    def reached(*args, **kwargs):
        raise Reached

    for module, name in ((calibrate, "calibrate_model"), (cache, "load_or_calibrate"),
                         (allocate, "budget_artifact"), (evaluation, "run_setting")):
        monkeypatch.setattr(module, name, reached)


def _paths(tmp_path) -> dict[str, str]:
    """The files and folders the cases name, made in ``tmp_path``."""
    (tmp_path / "empty").write_text("")
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "other-files").mkdir()
    (tmp_path / "other-files" / "notes.txt").write_text("keep me")
    (tmp_path / "bad-config").mkdir()
    (tmp_path / "bad-config" / "config.json").write_text("{")
    artifact = save_tiny_artifact(str(tmp_path / "artifact"), AttentionShape(64, 4, 2, 16))
    return {"empty": str(tmp_path / "empty"), "empty_dir": str(tmp_path / "empty-dir"),
            "other_files": str(tmp_path / "other-files"),
            "bad_config": str(tmp_path / "bad-config"), "artifact": artifact,
            "missing": str(tmp_path / "missing"), "out": str(tmp_path / "new-out")}


# (id, argv with {model} and the _paths keys, fragment of the one line)
CASES = [
    # estimate (the four cases first)
    ("estimate missing model", "estimate /nonexistent/model",
     "model '/nonexistent/model' does not exist; give a Hugging Face model folder"),
    ("estimate empty file", "estimate {empty}", "is a file, not a directory"),
    ("estimate --kv-cache-gib -1", "estimate {model} --kv-cache-gib -1",
     "argument --kv-cache-gib/--gpu-memory-gib: -1 is out of range: give more than 0"),
    ("estimate --context 0", "estimate {model} --context 0",
     "argument --context: 0 is out of range: give at least 1"),
    ("estimate folder without config.json", "estimate {empty_dir}",
     "model config '{empty_dir}/config.json' does not exist"),
    ("estimate malformed config.json", "estimate {bad_config}",
     "model '{bad_config}' cannot be read: It looks like the config file"),
    ("estimate --kv-cache-gib nan", "estimate {model} --kv-cache-gib nan", "nan is out of range"),
    ("estimate --kv-cache-gib 1e308", "estimate {model} --kv-cache-gib 1e308",
     "1e308 is out of range"),
    ("estimate --kv-cache-gib abc", "estimate {model} --kv-cache-gib abc", "'abc' is not a number"),
    ("estimate --block-size 0", "estimate {model} --block-size 0", "--block-size: 0 is out of"),
    ("estimate --tensor-parallel-size 0", "estimate {model} --tensor-parallel-size 0",
     "--tensor-parallel-size: 0 is out of range"),
    ("estimate --tensor-parallel-size 7", "estimate {model} --tensor-parallel-size 7",
     "tensor parallel size 7 must divide the 9 query and 3 KV heads"),
    ("estimate --concurrent-batches 0", "estimate {model} --concurrent-batches 0",
     "--concurrent-batches: 0 is out of range"),
    ("estimate --context 1.5", "estimate {model} --context 1.5", "'1.5' is not an integer"),
    ("estimate --config malformed", "estimate {model} --config {{bad", "is malformed JSON"),
    # calibrate
    ("calibrate --output a file", "calibrate {model} --output {empty}",
     "--output '{empty}' is a file, not a directory"),
    ("calibrate --output under a file", "calibrate {model} --output {empty}/artifact",
     "the folder of --output '{empty}' is a file, not a directory"),
    ("calibrate --output a folder of other files", "calibrate {model} --output {other_files}",
     "is a directory with other files in it, not an artifact"),
    ("calibrate missing model", "calibrate {missing} --output {out}", "does not exist"),
    ("calibrate --head-group-size 0", "calibrate {model} --output {out} --head-group-size 0",
     "--head-group-size: 0 is out of range"),
    ("calibrate --head-group-size 2", "calibrate {model} --output {out} --head-group-size 2",
     "--head-group-size 2 does not divide the model's 3 KV heads; give a divisor of 3"),
    ("calibrate --tokens 100", "calibrate {model} --output {out} --tokens 100",
     "--tokens 100 is out of range"),
    ("calibrate --rank-fraction 0", "calibrate {model} --output {out} --rank-fraction 0",
     "rank_fraction=0.0 is out of range"),
    ("calibrate --text missing", "calibrate {model} --output {out} --text {missing}",
     "calibration text '{missing}' does not exist"),
    # allocate
    ("allocate --output a file", "allocate {model} --output {empty} --compression 8",
     "--output '{empty}' is a file"),
    ("allocate --compression 1", "allocate {model} --output {out} --compression 1",
     "--compression: 1 is out of range: give more than 1"),
    ("allocate --bytes-per-token -5", "allocate {model} --output {out} --bytes-per-token -5",
     "--bytes-per-token: -5 is out of range"),
    ("allocate --ppl-increase 0", "allocate {model} --output {out} --ppl-increase 0",
     "--ppl-increase: 0 is out of range"),
    ("allocate --context 0", "allocate {model} --output {out} --compression 8 --context 0",
     "--context: 0 is out of range"),
    ("allocate --windows 0", "allocate {model} --output {out} --compression 8 --windows 0",
     "--windows: 0 is out of range"),
    ("allocate --block-size 0", "allocate {model} --output {out} --compression 8 --block-size 0",
     "--block-size: 0 is out of range"),
    ("allocate --artifact missing",
     "allocate {model} --output {out} --compression 8 --artifact {missing}",
     "--artifact '{missing}' does not exist"),
    ("allocate --artifact a file",
     "allocate {model} --output {out} --compression 8 --artifact {empty}",
     "--artifact '{empty}' is a file, not a directory"),
    ("allocate missing model", "allocate {missing} --output {out} --compression 8",
     "model '{missing}' does not exist"),
    # perplexity
    ("perplexity missing model", "perplexity {missing}", "model '{missing}' does not exist"),
    ("perplexity --tokens 0", "perplexity {model} --tokens 0", "--tokens: 0 is out of range"),
    ("perplexity --window 1", "perplexity {model} --window 1", "--window: 1 is out of range"),
    ("perplexity --window beyond the model", "perplexity {model} --window 100000",
     "--window 100000 does not fit the model's 8192 positions"),
    ("perplexity --dtype bogus", "perplexity {model} --dtype bogus",
     "argument --dtype: invalid choice: 'bogus'"),
    ("perplexity --config malformed", "perplexity {model} --config {{bad", "is malformed JSON"),
    # inspect
    ("inspect a file", "inspect {empty}", "artifact '{empty}' is a file, not a directory"),
    ("inspect missing", "inspect {missing}", "artifact '{missing}' does not exist"),
    ("inspect a folder without manifest", "inspect {empty_dir}", "has no manifest.json"),
    # prepare-model, and the command line itself
    ("prepare-model unknown name", "prepare-model nope", "unknown embedded model 'nope'"),
    ("prepare-model --cache-dir a file", "prepare-model --cache-dir {empty}",
     "--cache-dir '{empty}' is a file, not a directory"),
    ("no subcommand", "", "the following arguments are required: command"),
    ("unknown flag", "estimate {model} --bogus", "unrecognized arguments: --bogus"),
]

VALID = [  # reach their heavy step: the checks refuse nothing valid
    ("calibrate into a new folder", "calibrate {model} --output {out}"),
    ("calibrate over an artifact", "calibrate {model} --output {artifact} --head-group-size 3"),
    ("calibrate into an empty folder", "calibrate {model} --output {empty_dir}"),
    ("allocate", "allocate {model} --output {out} --compression 8"),
    ("perplexity", "perplexity {model} --window 1024 --tokens 1024"),
]


def _argv(template: str, model: str, paths: dict[str, str]) -> list[str]:
    return template.format(model=model, **paths).split()


@pytest.mark.parametrize("template,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_is_one_line_and_exit_2(template, fragment, model_path, tmp_path, capsys):
    paths = _paths(tmp_path)
    capsys.readouterr()
    logging.disable(logging.CRITICAL)  # see test_validation._refused
    try:
        with pytest.raises(SystemExit) as info:
            cli.main(_argv(template, model_path, paths))
    finally:
        logging.disable(logging.NOTSET)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert info.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("vllm-lowrank: error: "), lines[0]
    assert fragment.format(**paths) in lines[0], lines[0]


@pytest.mark.parametrize("template", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_arguments_reach_the_heavy_step(template, model_path, tmp_path):
    with pytest.raises(Reached):
        cli.main(_argv(template, model_path, _paths(tmp_path)))


def test_output_folder_of_other_files_is_kept(model_path, tmp_path):
    paths = _paths(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["calibrate", model_path, "--output", paths["other_files"]])
    assert os.listdir(paths["other_files"]) == ["notes.txt"]


def test_console_script_refuses_without_a_traceback():
    """The issue's first case through the installed ``vllm-lowrank`` script."""
    script = os.path.join(os.path.dirname(sys.executable), "vllm-lowrank")
    proc = subprocess.run([script, "estimate", "/nonexistent/model"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("vllm-lowrank: error: model '/nonexistent/model' does not")
