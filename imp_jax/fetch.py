"""`python -m imp_jax.fetch [ALIAS ...]`: fetch model aliases into $IMP_JAX_HOME ahead of time (CI, offline use)."""
from __future__ import annotations

import argparse
import logging
import sys

from imp_jax.errors import ImpError
from imp_jax.model.formats.hub import ALIASES, resolve_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m imp_jax.fetch", description=__doc__)
    ap.add_argument("aliases", nargs="*", default=sorted(ALIASES), help=f"default: all ({', '.join(sorted(ALIASES))})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in args.aliases:
        try:
            print(f"{name}: {resolve_model(name).path}")
        except ImpError as e:
            print(f"error: {e.message}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
