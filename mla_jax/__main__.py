import sys

from mla_jax.cli import main

sys.exit(main())
