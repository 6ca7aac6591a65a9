"""Code the test files share: input builders, configs, the models each comparison builds, process
launchers, oracles.

Test modules import shared code from here (``from _support.helpers import ...``; pytest puts
``tests/`` on ``sys.path``, and tests/conftest.py hands that path to child processes) and never
from another test module, so every test file collects and runs alone; tests/test_test_layout.py
checks it.
"""
