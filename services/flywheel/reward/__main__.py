from flywheel.reward.main import main

main()
