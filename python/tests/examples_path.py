"""Puts python/examples on sys.path so the tests can import the examples."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
