"""Real TF1 programs, written by us, that the corpus tests train with and without EPL."""
