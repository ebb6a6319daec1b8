from flywheel.gateway.main import main

main()
