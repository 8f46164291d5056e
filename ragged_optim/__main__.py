from ragged_optim.cli import main

raise SystemExit(main())
