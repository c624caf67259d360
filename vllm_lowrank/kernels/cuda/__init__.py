"""CUDA C++ kernels (``*.cu``, installed as package data) and their builder
:mod:`.ext`, which compiles them on first use."""
