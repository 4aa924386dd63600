"""Hugging Face interoperability: safetensors files, config.json and tensor names of Llama and Mixtral."""
