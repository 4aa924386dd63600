"""Token data: corpora, sources and the loader that feeds each process its slice of a global batch."""
