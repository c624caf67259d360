"""Low-rank factorization of key/value projections: plans, bases, ranks, folding."""
