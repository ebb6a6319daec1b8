from flywheel.teacher.main import main

main()
