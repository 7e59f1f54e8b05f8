import sys

from gdpo_ray.cli import main

sys.exit(main())
