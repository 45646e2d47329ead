module capstan/control-plane/relay

go 1.26.0
