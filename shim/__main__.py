from shim.cli import main

raise SystemExit(main())
