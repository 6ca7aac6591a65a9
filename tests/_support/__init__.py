"""Code the test files share: input builders, configs, process launchers, oracles.

Test modules import shared code from here (``from _support.helpers import ...``; pytest puts
``tests/`` on ``sys.path``, and tests/conftest.py hands that path to child processes). Some test
modules still reuse another test module's cases by name; tests/test_test_layout.py checks that
every such import resolves when a file runs alone.
"""
