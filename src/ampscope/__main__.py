from ampscope.cli import run

run()
