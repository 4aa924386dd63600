"""What every layer of the package uses and that imports nothing of it: crash-consistent files, console logging."""
