from shim.cli.main import main

raise SystemExit(main())
