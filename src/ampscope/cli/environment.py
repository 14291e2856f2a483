"""`ampscope --version -v`: ampscope's version, the torch build it runs on, and what of torch's
private details and ampscope's speed tricks this build allows (the plain `--version` imports
no torch; this report does)."""

from __future__ import annotations


def print_environment() -> None:
    import ampscope
    from ampscope.torchcompat import features, torch_build
    from ampscope.tricks import Trick, unavailable

    print(f"ampscope {ampscope.__version__}")
    print(f"torch {torch_build()}")
    print("torch details (detected once per process):")
    for f in features():
        print(f"  {'yes' if f.available else 'no ':3}  {f.name}: {f.detail}")
    missing = unavailable()
    print("speed tricks of predicted runs (--exact turns them all off):")
    for trick in Trick:
        why = missing.get(trick)
        print(f"  {'off' if why else 'on ':3}  {trick.value}" + (f": {why}" if why else ""))
