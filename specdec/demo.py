"""`make demo`: the embedded default model pair served by all three services (arrives with issue 8)."""
import sys


def main() -> int:
    print("specdec demo: not yet — the services and the bundled model pair land with issues 5 and 8.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
