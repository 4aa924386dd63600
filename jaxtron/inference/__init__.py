"""Using a trained model: text generation (``generate``)."""
