from graphrt.cli import main

raise SystemExit(main())
