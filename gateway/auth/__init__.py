"""Authentication: API keys and JWTs, each resolving a request to a `Principal`."""
