"""Train state, optimizer, the pure train step and the loop around it."""
