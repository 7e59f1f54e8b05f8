import sys

from gdpo_ray.run.cli import main

sys.exit(main())
