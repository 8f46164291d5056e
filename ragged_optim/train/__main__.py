from ragged_optim.train import main

raise SystemExit(main())
