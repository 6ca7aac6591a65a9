"""Code the test files share: input builders, configs, process launchers, oracles.

The one place test modules import shared code from (``from _support.helpers import ...``; pytest puts
``tests/`` on ``sys.path``, and tests/conftest.py hands that path to child processes). A test module
never imports another test module: tests/test_test_layout.py checks it.
"""
