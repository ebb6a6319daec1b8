from flywheel.engine.main import main

main()
