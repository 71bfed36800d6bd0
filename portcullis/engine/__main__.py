"""`python -m portcullis.engine [MODEL] [flags]`: the engine's private OpenAI-compatible server.

Every engine process starts here (`portcullis engine` and `portcullis serve` run this module), and
tensor-parallel workers inherit its environment, so OpenMP's spin-wait is bounded here first."""
if __name__ == "__main__":
    from portcullis.engine.openmp import bound_spinning

    bound_spinning()  # before torch is imported (`portcullis.engine.openmp`)
    from portcullis.engine.server.cli import main

    raise SystemExit(main())
