"""Content-addressed artifacts (a run's base checkpoint, files too big for a DHT value) shared over P2P."""
