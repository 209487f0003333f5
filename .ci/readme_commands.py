"""Print the commands of the README's Quickstart block, one per line (comments and blank lines skipped)."""

import sys


def quickstart_commands(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "## Quickstart")
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return [line.strip() for line in lines[fence + 1:end] if line.strip() and not line.lstrip().startswith("#")]


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print("\n".join(quickstart_commands(f.read())))
