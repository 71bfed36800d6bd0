"""`python -m portcullis.engine [MODEL] [flags]`: the engine's private OpenAI-compatible server."""
from portcullis.engine.server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
