"""Authentication: API keys (their format and keys file, `keys`) and JWTs, each resolving a
request to a `Principal`."""
