import sys

from nodeagent.entry import main

sys.exit(main())
