"""What an experiment is: the manifest (pydantic, frozen to a canonical id) and the DeepSpeed config import."""
