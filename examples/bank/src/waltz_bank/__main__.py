import sys

from waltz_bank.demo import main

sys.exit(main())
