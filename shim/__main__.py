from shim.app.cli import main

raise SystemExit(main())
