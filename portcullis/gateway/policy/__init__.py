"""Policy as YAML: the pydantic models (the schema), the loader, and the hot-reloading store."""
