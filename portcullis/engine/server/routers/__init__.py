"""The engine server's routes, one router per concern."""
