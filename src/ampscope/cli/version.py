"""`ampscope --version -v`: ampscope's version, the torch build it runs on, and what of torch's
private details and ampscope's speed tricks this build allows (the plain `--version` imports
no torch; this report does)."""

from __future__ import annotations


def print_environment() -> None:
    import ampscope
    from ampscope.torchcompat import features, torch_build
    from ampscope.tricks import Trick, status

    print(f"ampscope {ampscope.__version__}")
    print(f"torch {torch_build()}")
    print("torch details (detected once per process):")
    for f in features():
        # A missing detail's line says why, then what is off without it.
        off = f" (off: {f.needed_by})" if not f.available and f.needed_by else ""
        print(f"  {'yes' if f.available else 'no ':3}  {f.name}: {f.detail}{off}")
    print("speed tricks of predicted runs (--exact turns them all off):")
    for trick in Trick:
        # What each uses where it is on, why it is off where it is not.
        on, why = status(trick)
        print(f"  {'on ' if on else 'off':3}  {trick.value}: {why}")
