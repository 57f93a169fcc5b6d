import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `from tests.conftest import REPO` and train.py imports
    sys.path.insert(0, str(REPO))
