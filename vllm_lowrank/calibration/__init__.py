"""Calibration on real text and the on-disk compression artifact."""
