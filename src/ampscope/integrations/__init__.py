"""Training frameworks' callbacks that trace one step of a real run with `ampscope.watch`.

- `hf.py`: `AmpscopeCallback`, a Hugging Face `transformers.TrainerCallback`;
- `lightning.py`: `AmpscopeCallback`, a Lightning `Callback`.

Each module imports its framework, so neither is imported until it is used: `import ampscope`
needs neither installed.
"""
