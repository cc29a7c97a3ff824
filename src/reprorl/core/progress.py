"""Progress bars for the long stages, written to stderr (the rule's log file)."""

import sys

from tqdm import tqdm


def progress(total: int, desc: str, initial: int = 0) -> tqdm:
    """A plain-ASCII bar refreshed at most every 10 s, so logs stay short."""
    return tqdm(total=total, initial=initial, desc=desc, mininterval=10, file=sys.stderr,
                ascii=True, disable=False, dynamic_ncols=False, ncols=100)
