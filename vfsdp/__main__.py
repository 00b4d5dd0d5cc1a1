from vfsdp.cli import main

raise SystemExit(main())
