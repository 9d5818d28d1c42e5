"""HF <-> Megatron weights: the mapping table, streaming safetensors I/O, loading into models."""
