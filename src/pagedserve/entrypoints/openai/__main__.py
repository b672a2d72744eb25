import sys

from pagedserve.entrypoints.openai.api_server import main

sys.exit(main())
