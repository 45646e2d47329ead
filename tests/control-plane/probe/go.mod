module capstan/control-plane/probe

go 1.26.0
