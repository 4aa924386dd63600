"""`python -m jaxtron.checkpoint verify WORKDIR`: the same as `jaxtron verify WORKDIR`."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import main
    sys.exit(main(commands=("verify",)))
