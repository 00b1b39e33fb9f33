"""`python -m segctl.orchestrator.cli`: the `segctl` command without its console script."""

from segctl.orchestrator.cli import main

if __name__ == "__main__":
    main()
