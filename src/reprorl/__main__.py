from reprorl.cli import main

raise SystemExit(main())
