import sys

from hf_mars.cli import main

sys.exit(main())
