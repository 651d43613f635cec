import sys

from services.training.cli import main

sys.exit(main(sys.argv[1:]))
