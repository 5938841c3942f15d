from pykv.cli import main

raise SystemExit(main())
