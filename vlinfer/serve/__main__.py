import sys

from vlinfer.serve import main

sys.exit(main())
